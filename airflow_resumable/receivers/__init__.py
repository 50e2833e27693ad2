"""Ready-made receivers: the ``notify``/``verify`` pair of a side-effect step for a common kind of
outside system - an HTTP service (:mod:`.http`) and e-mail over SMTP with an IMAP archive (:mod:`.smtp`)."""
