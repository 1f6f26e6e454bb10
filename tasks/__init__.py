"""The work as plain functions, in rooms that follow the data flow: plan, cache, stage 1, 2."""
