"""Loads a gpukit PyTorch-format snapshot with Python's standard pickle module and checks what PyTorch's memory viewer
(MemoryViz.js / torch.cuda._memory_viz) reads: segments with their blocks, device_traces with their entries.

usage: check_pytorch_snapshot.py FILE SEGMENTS EVENTS ALLOCATED_BLOCKS TAG
Prints what it found; exits 1 with a message on the first mismatch.

Beyond the keys, what the viewer needs of them:
- every APPENDS and SETITEMS of the pickle holds at most 1000 items (as Python's pickle writes them): MemoryViz.js's
  unpickler pushes a batch as function arguments, which overflows JavaScript's stack for big ones;
- every trace entry has a frame, and so has every allocated block, or block whose free waits for other streams
  (active_pending_free), whose alloc the trace holds (an empty list makes the viewer say the block was allocated
  before the history was recorded); a block whose alloc the trace does not hold has none;
- such a pending block keeps its requested_size;
- an expandable segment's mapped ranges have the stream of the segment_map and segment_unmap events that touch them:
  replaying the trace backwards, the viewer merges a range with its neighbours only when their streams are equal."""
import pickle
import pickletools
import sys


def fail(message):
    print("check_pytorch_snapshot: " + message)
    sys.exit(1)


def check_batches(data, limit=1000):
    """Fails if an APPENDS or SETITEMS takes more than `limit` items off the unpickler's stack (since its MARK)."""
    mark = object()
    stack = []
    largest = 0
    for op, _, pos in pickletools.genops(data):
        before, after = op.stack_before, op.stack_after
        if pickletools.markobject in before:  # [..., markobject, stackslice]: everything down to the last MARK
            values = 0
            while stack and stack[-1] is not mark:
                stack.pop()
                values += 1
            if not stack:
                fail("%s at byte %d without a MARK" % (op.name, pos))
            stack.pop()
            items = values // 2 if op.name == "SETITEMS" else values
            if op.name in ("APPENDS", "SETITEMS"):
                largest = max(largest, items)
                if items > limit:
                    fail("%s at byte %d takes %d items at once (at most %d: the viewer pushes them as arguments)"
                         % (op.name, pos, items, limit))
            below = before[:before.index(pickletools.markobject)]
        else:
            below = before
        if below:
            del stack[-len(below):]
        stack.extend(mark if x is pickletools.markobject else None for x in after)
    return largest


def main():
    path, segments, events, allocated_blocks, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    with open(path, "rb") as f:
        data = f.read()
    largest_batch = check_batches(data)
    snapshot = pickle.loads(data)
    if not isinstance(snapshot, dict) or set(snapshot) != {"segments", "device_traces"}:
        fail("the top level is not a dict of segments and device_traces: %r" % type(snapshot))
    if len(snapshot["segments"]) != segments:
        fail("%d segments, expected %d" % (len(snapshot["segments"]), segments))
    seen_allocated = 0
    seen_tag = False
    for seg in snapshot["segments"]:
        for key, kind in (("device", int), ("address", int), ("total_size", int), ("allocated_size", int),
                          ("active_size", int), ("requested_size", int), ("stream", int), ("segment_type", str),
                          ("segment_pool_id", tuple), ("is_expandable", bool), ("frames", list), ("blocks", list)):
            if not isinstance(seg.get(key), kind):
                fail("segment key %s is %r" % (key, seg.get(key)))
        if not 0 <= seg["stream"] < 2 ** 63:
            fail("segment stream %#x does not fit the viewer's 8-byte integers" % seg["stream"])
        if seg["segment_type"] not in ("small", "large"):
            fail("segment_type %r" % seg["segment_type"])
        address = seg["address"]
        allocated = 0
        for block in seg["blocks"]:
            if block["address"] != address:
                fail("blocks do not tile their segment at %#x" % address)
            if block["state"] not in ("active_allocated", "active_pending_free", "inactive"):
                fail("block state %r" % block["state"])
            if block["state"] == "active_allocated":
                seen_allocated += 1
                allocated += block["size"]
                if block["requested_size"] <= 0 or block["requested_size"] > block["size"]:
                    fail("requested_size %d of a block of %d" % (block["requested_size"], block["size"]))
            for frame in block["frames"]:
                if frame["name"] == tag and isinstance(frame["line"], int) and isinstance(frame["filename"], str):
                    seen_tag = True
            address += block["size"]
        if address != seg["address"] + seg["total_size"]:
            fail("the blocks of the segment at %#x do not add up to its total_size" % seg["address"])
        if allocated != seg["allocated_size"]:
            fail("allocated_size %d, blocks say %d" % (seg["allocated_size"], allocated))
    if seen_allocated != allocated_blocks:
        fail("%d allocated blocks, expected %d" % (seen_allocated, allocated_blocks))
    if not seen_tag:
        fail("no block carries the tag %r as a frame" % tag)
    traces = snapshot["device_traces"]
    if not isinstance(traces, list) or not traces:
        fail("device_traces is empty")
    trace = traces[-1]
    if len(trace) != events:
        fail("%d trace entries, expected %d" % (len(trace), events))
    allocated_in_trace = {entry["addr"] for entry in trace if entry.get("action") == "alloc"}
    for seg in snapshot["segments"]:
        for block in seg["blocks"]:
            if block["state"] not in ("active_allocated", "active_pending_free"):
                continue
            if block["address"] in allocated_in_trace:
                if not block["frames"]:
                    fail("the %s block at %#x has no frame though the trace holds its alloc"
                         % (block["state"], block["address"]))
                if block["requested_size"] <= 0:
                    fail("the %s block at %#x has requested_size %d"
                         % (block["state"], block["address"], block["requested_size"]))
            elif block["frames"]:
                fail("the block at %#x has frames though the trace does not hold its alloc" % block["address"])
    for entry in trace:
        if entry.get("action") not in ("segment_map", "segment_unmap"):
            continue
        begin, end = entry["addr"], entry["addr"] + entry["size"]
        for seg in snapshot["segments"]:
            touches = seg["address"] <= end and begin <= seg["address"] + seg["total_size"]
            if seg["is_expandable"] and touches and seg["stream"] != entry["stream"]:
                fail("the mapped range at %#x has stream %#x, the %s at %#x next to it stream %#x: the viewer keeps "
                     "them apart" % (seg["address"], seg["stream"], entry["action"], begin, entry["stream"]))
    actions = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
               "segment_unmap", "snapshot", "oom"}
    last_time = 0
    for entry in trace:
        if entry["action"] not in actions:
            fail("action %r" % entry["action"])
        address_key = "device_free" if entry["action"] == "oom" else "addr"
        for key in (address_key, "size", "stream", "time_us"):
            if not isinstance(entry.get(key), int):
                fail("trace entry key %s is %r" % (key, entry.get(key)))
        if not 0 <= entry["stream"] < 2 ** 63:
            fail("trace entry stream %#x does not fit the viewer's 8-byte integers" % entry["stream"])
        if not isinstance(entry["frames"], list) or not entry["frames"]:
            fail("trace entry %r has no frame (the viewer says it happened before the history was recorded)"
                 % entry["action"])
        for frame in entry["frames"]:
            if not (isinstance(frame.get("name"), str) and isinstance(frame.get("filename"), str)
                    and isinstance(frame.get("line"), int)):
                fail("trace entry frame %r" % frame)
        if entry["time_us"] < last_time:
            fail("time_us goes back")
        last_time = entry["time_us"]
    print("check_pytorch_snapshot: %d segments, %d allocated blocks, %d trace entries, batches of at most %d items: "
          "the viewer's keys are there" % (len(snapshot["segments"]), seen_allocated, len(trace), largest_batch))


main()
