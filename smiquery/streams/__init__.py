"""The stream engine (:mod:`.engine`, no I/O) and its thread driver (:mod:`.sync`): the CSV and pmon streams."""
