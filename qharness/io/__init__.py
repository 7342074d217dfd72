"""The base's file and process plumbing, one job per module: ``atomic.py`` (atomic writes of files, directories and
checkpoints), ``disk.py`` (a full disk as one ``DiskFullError`` line), ``temps.py`` (temporaries of killed writers
removed), ``locks.py`` (the run-directory lock; ``hold_lock``, the shared-cache lock that says whom it waits for),
``names.py`` (names and paths from a user's value stay inside their directory), ``yaml_reader.py`` (the one YAML
reader, refusing duplicate keys)."""
