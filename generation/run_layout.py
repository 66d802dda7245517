"""Where a training run keeps the exports that generation reads: `<run>/checkpoints/step-XXXXXXX/export/`.

Training writes this layout (training.run, training.checkpoint_folders) and generation reads it, to take a run
folder for the export of its newest checkpoint (generation.export.find_export). It lives here, on generation's
floor and apart from the export's weights and Hub code, so that both can name it and train.py can list a run's
checkpoints before it imports torch's companions.
"""

import re

CHECKPOINTS_FOLDER = "checkpoints"  # in the run directory
CHECKPOINT_PATTERN = re.compile(r"^step-(\d{7,})$")  # the checkpoint folders in it, by optimiser step
