"""Multi-model queries: apps (trees of models with one end-to-end SLO), their SLO split, deadline
propagation and glue. The app model and the deadline rules here are pure and clock-free; the
planner, the simulator and the daemon all use them."""
