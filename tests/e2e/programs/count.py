"""Prints N numbered lines, one every SECONDS, writes count.txt (the last line) in its working
directory, then exits with CODE: a coordinator's program that needs no TensorFlow (detached runs on
fake servers).

    count.py N SECONDS [CODE]
"""

import os
import sys
import time

n, every = int(sys.argv[1]), float(sys.argv[2])
code = int(sys.argv[3]) if len(sys.argv) > 3 else 0
attempt = os.environ.get("DTF_ATTEMPT", "?")
for i in range(1, n + 1):
    print(f"line {i} of {n} (attempt {attempt})", flush=True)
    time.sleep(every)
with open("count.txt", "w") as f:
    f.write(f"{n} lines, attempt {attempt}\n")
sys.exit(code)
