import os

with open("/dev/fd/3", "rb") as f:
    vals = sorted({v for v in f.read().split(b"\n") if v}, key=lambda v: (-len(v), v))
try:
    import fcntl

    fcntl.fcntl(0, 1031, 1 << 20)  # F_SETPIPE_SZ: fewer, larger reads
except Exception:
    pass
pat = None  # compiled at the first secret seen: importing re is a third of the start
fast = None  # bytearray.find is slow on some output; a compiled literal search keeps its speed
seen = 0
keep = max([len(v) for v in vals] + [1]) - 1
limit = max(65536, keep)
cr = not any(b"\r" in v for v in vals)
# per value, its bytes to look for first (upper case first, then other non-letters, then the rest): a
# chunk without the picked byte cannot hold the value, and that memchr costs a small part of a search.
# A pick found without its value gives way to the next byte of the value, so the check settles on a byte
# the rank does not print, where the value has one.
bytesof = [
    sorted(set(v), key=lambda c: (not 65 <= c <= 90, c < 128 and chr(c).isalnum(), v.index(c))) for v in vals
]
pick = [0] * len(vals)
size = 1 << 20
buf = bytearray(limit + size)  # what waits, then one read: reused (a new 1 MiB a read cost page faults)
mv = memoryview(buf)
held = 0
while True:
    got = os.readv(0, [mv[held : held + size]])
    n = held + got
    cut = n
    if got:
        # what waits (held) has no line end: only the new bytes are searched, \r past the last \n only
        cut = buf.rfind(b"\n", held, n) + 1
        if cr:
            cut = buf.rfind(b"\r", max(cut, held), n) + 1 or cut
        if n - cut > limit:
            cut = n - keep
        if not cut:
            held = n
            continue
    # a match starting before the cut ends by cut + keep: leftmost, longest first, in one pass
    end = min(n, cut + keep)
    out = mv[:cut]
    seen += got
    if fast is None and seen > 4 << 20:  # a rank that prints a lot: compiled searches, 3-4x the speed of find
        import re

        fast = [re.compile(re.escape(v)).search for v in vals]
    found = False
    for i, v in enumerate(vals):
        if buf.find(bytesof[i][pick[i]], 0, end) < 0:
            continue
        if fast[i](buf, 0, end) if fast else buf.find(v, 0, end) >= 0:
            found = True
            break
        pick[i] = (pick[i] + 1) % len(bytesof[i])
    if found:
        if pat is None:
            import re

            pat = re.compile(b"|".join(re.escape(v) for v in vals))
        parts, pos = [], 0
        for m in pat.finditer(buf, 0, end):
            if m.start() >= cut:
                break
            parts += [buf[pos : m.start()], b"***"]
            pos = m.end()
        cut = max(cut, pos)
        parts.append(buf[pos:cut])
        out = memoryview(b"".join(parts))
    while out:
        out = out[os.write(1, out) :]
    held = n - cut
    if held:
        buf[:held] = buf[cut:n]
    if not got:
        break
