"""The stream engine (:mod:`.engine`, no I/O) and its drivers: the CSV (:mod:`.sync`), pmon and asyncio streams."""
