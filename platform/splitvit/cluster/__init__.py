"""Where work meets a cluster: the local stack (:mod:`.stack`), job submission
(:mod:`.submit`), and the checks made before any Ray work starts (:mod:`.preflight`)."""
