# Run by the host's python as `python -c THIS TAR DEST once|merge` (dtf.collective.remote_files's
# send_tree): unpack TAR into DEST (with `once`: only where DEST is missing, replacing it
# atomically; with `merge`: into it), then remove TAR. Standard library only: the host's python.
import os
import shutil
import sys
import tarfile
import uuid

tar, dest, once = sys.argv[1], sys.argv[2], sys.argv[3] == "once"
try:
    if once and os.path.isdir(dest):
        sys.exit(0)
    target = dest + ".tmp-" + uuid.uuid4().hex[:8] if once else dest
    os.makedirs(target, exist_ok=True)
    with tarfile.open(tar) as t:
        t.extractall(target, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(target)
    if once:
        try:
            os.rename(target, dest)
        except OSError:
            shutil.rmtree(target, ignore_errors=True)  # another dtf put it there first
finally:
    os.unlink(tar)
