"""Who decides k: the draft-length policy (measured costs and acceptance), and the confidence a head's drafts
are valued by."""
