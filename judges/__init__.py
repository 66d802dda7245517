"""Independent judges of generated images of the built-in data sets (training.builtin_data): classifiers fitted on
the real images, which say whether a sample shows the class it was asked for, and the real images themselves with
the Inception features FID compares samples against.

    judges.digits       scikit-learn's digits: an RBF SVC on the pixels; Inception batches of digit images
    judges.digits_reference   the real digits' Inception features; for all 1797 with the bundled weights, the
                        reference of every digits FID: computed once per user in the code path of the published
                        scores, checked against a committed digest (digits_inception_pool3_digest.npz), cached
    judges.shapes       the coloured shapes: a logistic regression on centred pixels
    judges.classifier   what both classifiers share: fitted on 75 % of the real images, measured on the rest

The demo (demo.py), the studies (studies/) and bench.demo score with them, so they sit above training, whose data
sets they read, and below every caller. Each module imports scikit-learn, torch and the project's training code
only where it uses them.
"""
