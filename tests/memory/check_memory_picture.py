"""Checks a gpukit memory picture (memory_picture_html) as a browser would see its DOM: parsed with Python's
html.parser, or, with --dom, the DOM that headless Chromium dumped after rendering (chromium --headless --dump-dom).

usage: check_memory_picture.py FILE SEGMENTS BLOCKS ALLOCATED_BLOCKS [--dom] [--mapped BYTES]
SEGMENTS counts the segment bars (an expandable segment has one per mapped range), BLOCKS the block rectangles. With
--mapped, the bars' data-size must add up to BYTES (the memory reserved: an expandable segment's reserved range is
address space, not memory). The page must be UTF-8 without the control characters HTML forbids, and every block must
lie inside its bar. Exits 1 with a message on the first mismatch."""
import re
import sys
from html.parser import HTMLParser


class Picture(HTMLParser):
    def __init__(self):
        super().__init__()
        self.segments = []
        self.blocks = []
        self.lines = {}
        self.open_rect = None
        self.titles = 0
        self.row_blocks = []
        self.outside = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "g" and "segment-row" in classes:
            self.row_blocks = []
        if tag == "rect" and "segment" in classes:
            self.segments.append(a)
            left, right = float(a["x"]), float(a["x"]) + float(a["width"])
            for b in self.row_blocks:  # a block is drawn at least 0.5 wide; coordinates have one decimal
                if float(b["x"]) < left - 0.05 or float(b["x"]) + float(b["width"]) > max(right, left + 0.5) + 0.15:
                    self.outside.append((b.get("data-state"), a.get("data-address")))
        if tag == "rect" and "block" in classes:
            self.blocks.append(a)
            self.row_blocks.append(a)
        if tag == "polyline":
            self.lines[classes[0] if classes else ""] = a.get("points", "").split()
        if tag == "title":
            self.titles += 1


def main():
    path, segments, blocks, allocated = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    p = Picture()
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        sys.exit("check_memory_picture: the page is not UTF-8, as it declares: %s" % e)
    control = re.search("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]", text)
    if control:
        sys.exit("check_memory_picture: the control character %r at %d, which HTML does not allow"
                 % (control.group(), control.start()))
    p.feed(text)
    if len(p.segments) != segments:
        sys.exit("check_memory_picture: %d segment bars, expected %d" % (len(p.segments), segments))
    if len(p.blocks) != blocks:
        sys.exit("check_memory_picture: %d blocks, expected %d" % (len(p.blocks), blocks))
    states = [b.get("data-state") for b in p.blocks]
    if states.count("allocated") != allocated:
        sys.exit("check_memory_picture: %d allocated blocks, expected %d" % (states.count("allocated"), allocated))
    for name in ("allocated", "reserved", "largest_free"):
        if len(p.lines.get(name, [])) < 2:
            sys.exit("check_memory_picture: the %s line has fewer than 2 points" % name)
    if p.outside:
        sys.exit("check_memory_picture: %d blocks drawn outside their segment's bar, e.g. %r" % (len(p.outside), p.outside[0]))
    if "--mapped" in sys.argv:
        mapped = int(sys.argv[sys.argv.index("--mapped") + 1])
        drawn = sum(int(a["data-size"]) for a in p.segments)
        if drawn != mapped:
            sys.exit("check_memory_picture: the segment bars span %d bytes, %d are mapped" % (drawn, mapped))
    if p.titles < blocks + segments:
        sys.exit("check_memory_picture: %d hover titles for %d blocks and %d segments" % (p.titles, blocks, segments))
    print("check_memory_picture: %d segments, %d blocks (%d allocated), timeline of %d points%s"
          % (segments, blocks, allocated, len(p.lines["allocated"]), " (DOM from Chromium)" if "--dom" in sys.argv else ""))


main()
