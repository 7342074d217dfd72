"""A run as a whole: the tail that chains deploy -> checks -> benchmark -> evaluation, and the run summary it writes."""
