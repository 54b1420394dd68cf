"""Checks a gpukit memory picture (memory_picture_html) as a browser would see its DOM: parsed with Python's
html.parser, or, with --dom, the DOM that headless Chromium dumped after rendering (chromium --headless --dump-dom).

usage: check_memory_picture.py FILE SEGMENTS BLOCKS ALLOCATED_BLOCKS [--dom]
Exits 1 with a message on the first mismatch."""
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

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "rect" and "segment" in classes:
            self.segments.append(a)
        if tag == "rect" and "block" in classes:
            self.blocks.append(a)
        if tag == "polyline":
            self.lines[classes[0] if classes else ""] = a.get("points", "").split()
        if tag == "title":
            self.titles += 1


def main():
    path, segments, blocks, allocated = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    p = Picture()
    with open(path, encoding="utf-8") as f:
        p.feed(f.read())
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
    if p.titles < blocks + segments:
        sys.exit("check_memory_picture: %d hover titles for %d blocks and %d segments" % (p.titles, blocks, segments))
    print("check_memory_picture: %d segments, %d blocks (%d allocated), timeline of %d points%s"
          % (segments, blocks, allocated, len(p.lines["allocated"]), " (DOM from Chromium)" if "--dom" in sys.argv else ""))


main()
