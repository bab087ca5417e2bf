"""A Jupyter kernel (or any Python process) as the coordinator of a dtf cluster: `connection`
(`dtf.connect()` and its handle), `calls` (the coordinator calls that end with one clear error when
the cluster goes away), `kernel` (what a kernel needs in-process: dtf's hooks, TensorFlow's noise
kept out of the cells; the kernel `dtf train NOTEBOOK.ipynb` runs) and `execute` (`dtf train
NOTEBOOK.ipynb`'s runner, with nbclient). It is part of the program's layer (dtf.program, and `dtf`
itself, whose `dtf.connect` is `connection.connect`): it may import what dtf.program may, and
dtf.program. ipykernel, nbclient and nbformat (the `notebook` extra) are imported only by `kernel`'s
and `execute`'s entry points, never by `import dtf` or the CLI.
"""
