"""Training in latent (or pixel) space under Accelerate: configs, data, VAE, EMA and checkpoints.

`train.py` composes these modules; `python -m training.latents` pre-extracts VAE latents.
"""
