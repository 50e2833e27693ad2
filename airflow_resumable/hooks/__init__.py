"""Where things are: the journal a task, the CLI or the page opens (:mod:`.journal`)."""
