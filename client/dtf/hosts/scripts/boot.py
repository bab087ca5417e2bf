# The python a launcher call over an OpenSSH master runs on the host (dtf.hosts.control's
# put_and_converse), as `python -c THIS SIZE PATH TMP ARGS...`: read the upload from stdin to its
# last byte (the rest of stdin is the command's), write it under the temporary name TMP in its
# directory (made here: a `sh -c 'mkdir -p DIR && exec python ...'` would be a shell and a mkdir
# more on every host), rename it to PATH, then run it as `python PATH ARGS` runs a zipapp (the
# launcher): PATH first on sys.path (in place of `-c`'s current directory, whose modules must not
# shadow the launcher's, nor TensorFlow's in the servers it forks), its __main__ run as __main__.
# Not runpy.run_path: its imports (runpy, pkgutil) are a cost on every host past python's own
# start; zipimport is python's own, already loaded. Standard library only: the host's python.
import os
import sys
import zipimport

size, path, tmp = int(sys.argv[1]), sys.argv[2], sys.argv[3]
data = bytearray()
while len(data) < size:
    chunk = os.read(0, min(1 << 20, size - len(data)))
    if not chunk:
        sys.exit("the upload ended early")
    data += chunk
try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
except OSError as e:
    try:
        os.unlink(tmp)
    except OSError:
        pass
    sys.exit(f"upload to {os.path.dirname(path)} failed: {e.strerror or e}")
sys.argv = [path, *sys.argv[4:]]
sys.path[0] = path
main = zipimport.zipimporter(path).get_code("__main__")
exec(main, {"__name__": "__main__", "__file__": f"{path}/__main__.py", "__builtins__": __builtins__})
