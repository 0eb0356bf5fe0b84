"""Where the two programs come from, and the one form they all arrive in.

`graphfile`: the JSON graph format (`seq.json`, `dist.json`, `schema/graph-v1.json`) loaded
and validated (`load_seq`, `load_dist`); `build`: such documents written from Python;
`capture`: real PyTorch training steps traced into them; `importer`: other tools' graph
dumps translated into them. In: files, Python code or dumps. Out: a validated sequential
`Graph` and a `Dist` (mesh, rank graphs, relations, expectations), or an `InputError` that
names the file and the place in it.
"""
