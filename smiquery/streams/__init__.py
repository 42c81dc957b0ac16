"""The stream engine (:mod:`.engine`, no I/O) and its thread drivers: the CSV (:mod:`.sync`) and pmon streams."""
