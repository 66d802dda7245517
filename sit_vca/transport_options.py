"""What a user chooses about the interpolant objective's training, as plain data (the config's transport.*).

No torch here: training's config schema and `train.py --help` read these without importing sit_vca.transport,
which uses them."""

TIME_DISTRIBUTIONS = ("uniform", "logit-normal")  # of the training times, on the training interval
