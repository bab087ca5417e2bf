"""The bytes free for an unprivileged user in the file system of the directory argv[1], on stdout:
run as `python -c THIS DIR` where a copy failed (dtf.hostops.environments: SFTP says only
"Failure" when the disk is full). Standard library only: the host's python."""

import os
import sys

s = os.statvfs(sys.argv[1])
print(s.f_bavail * s.f_frsize)
