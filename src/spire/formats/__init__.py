"""On-disk formats below the draft kinds: the draft file every trained draft writes (:mod:`.draft_file`) and the
speculators-layout ``config.json`` of an exported draft (:mod:`.speculators`). The kinds write through them;
:mod:`spire.export` picks the kind's writer."""
