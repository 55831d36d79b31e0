"""Runtime: lowering a plan into something that runs, and the run modes."""
