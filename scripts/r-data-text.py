"""Writes character data sets of an installed R package's lazy-load database as text files.

    python r-data-text.py RDATA_BASE OUT_DIR NAME...

RDATA_BASE is the database without its suffix (`.../site-library/PKG/data/Rdata`): the .rdx
index (gzip) maps each data set to an (offset, length) in the .rdb, whose entries are a 4-byte
length and a zlib stream of one serialized R object. Each NAME, a character vector, is written
to OUT_DIR/NAME.txt one element per line (joined with newlines, a final newline added), with
line ends normalized to LF. Needs `rdata` (PyPI); used by heldout-texts.sh and
calibration-text.sh.
"""
import gzip
import sys
import zlib

import rdata

base, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(open(base + ".rdx", "rb").read())))
blob = open(base + ".rdb", "rb").read()
for name in names:
    off, length = (int(x) for x in index["variables"][name])
    lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[off + 4:off + length])))
    text = "\n".join(str(x) for x in lines) + "\n"
    with open(f"{out}/{name}.txt", "w", encoding="utf-8") as f:
        f.write(text.replace("\r\n", "\n").replace("\r", "\n"))
