"""The training tasks of ``transformer-reference train``: the copy task, the numbers task (English number words
to French) and a user's parallel corpus; each makes batches, held-out sets and scores."""
