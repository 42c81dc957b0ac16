"""``smiquery ps``: the command (:mod:`.command`), /proc look-ups (:mod:`.proc`) and ``--watch`` (:mod:`.watch`)."""
