"""demo.py's scoring parts: the real digits as sample files store them, the independent classifier, the
report. (The demo itself trains for minutes: `make demo`, not `make test`.)"""

import numpy as np

import demo


def test_real_digits_are_stored_like_samples():
    from sklearn.datasets import load_digits

    images, labels = demo.real_digits()
    reference = load_digits()
    assert images.dtype == np.uint8 and images.shape == (1797, 8, 8, 3)
    np.testing.assert_array_equal(labels, reference.target)
    # Digits hold 0..16; the training data maps v to x = v/8 - 1 and sample files store
    # floor(127.5 x + 128), i.e. v * 255/16 rounded half up (computed here in exact integer arithmetic).
    expected = (reference.images.astype(np.int64) * 255 * 2 + 16) // 32
    for channel in range(3):
        np.testing.assert_array_equal(images[..., channel], expected)


def test_classifier_recognises_real_digits_and_checks_the_labels():
    images, labels = demo.real_digits()
    classifier = demo.fit_classifier(images, labels)
    # scikit-learn's SVC scores 98-99 % on held-out digits (measured here: 98.9 %); 97 % leaves room for
    # library versions without letting a broken feature map (~10 %) pass.
    assert classifier.held_out_accuracy >= 0.97
    assert classifier.train_size + classifier.test_size == 1797
    assert classifier.accuracy(images, labels) >= classifier.held_out_accuracy - 0.01  # mostly seen data
    wrong = (labels + 1) % 10  # every label off by one: a sound accuracy must collapse
    assert classifier.accuracy(images, wrong) < 0.05


def test_report_lists_every_set_against_its_goal():
    results = {
        "train": {"steps": 3000, "seconds_this_invocation": 301.0, "final_loss": 0.0812, "steps_per_s": 10.2},
        "model": "DiT-S/2 (vca, hidden 128, depth 4, 4 heads)",
        "num_samples": 1000,
        "num_real": 1797,
        "real_file": "results/demo/real-digits.npz",
        "sampler": "DDIM, 50 steps",
        "classifier": {"kind": "SVC", "held_out_accuracy": 0.9889, "train_size": 1347, "test_size": 450},
        "inception_weights": "bundled",
        "fid_real_halves": {"fid": 3.21, "sizes": [899, 898]},
        "sets": [
            {"cfg_scale": 1.0, "fid": 12.345, "accuracy": 0.962, "goal": 0.95, "grid": "samples-cfg1.png"},
            {"cfg_scale": 2.0, "fid": None, "accuracy": 0.985, "goal": 0.99, "grid": "samples-cfg2.png"},
        ],
        "seconds": {"train": 300.0, "sample": 120.0, "score": 240.0, "total": 660.0},
    }
    markdown = demo.render_markdown(results)
    assert "| 1 | 12.35 | 96.2 % | ≥ 95 % (met) | ![](samples-cfg1.png) |" in markdown
    assert "| 2 | – | 98.5 % | ≥ 99 % (missed) | ![](samples-cfg2.png) |" in markdown  # FID not measured
    assert "trained 3000 steps (final loss 0.0812" in markdown and "98.9 % on the 450 held out" in markdown
    assert "(899 vs. 898) are 3.21 apart" in markdown
    assert (
        "`python -m fid SET.npz results/demo/real-digits.npz --weights bundled --metrics fid`" in markdown
        and "11.0 min in all (training 5.0" in markdown
    )


def test_committed_real_digit_features_match_a_fresh_computation(bundled_inception):
    # demo.REAL_FEATURES holds the Inception pool_3 features of the 1797 real digits (bundled weights), computed
    # once; recompute a spot check spread over the whole file (every 43rd digit: 42 images, every class among
    # them) and compare. Other weights, another preprocessing or another order would change every row.
    from fid import extract_features

    images, _ = demo.real_digits()
    spot = slice(0, None, 43)
    with np.load(demo.REAL_FEATURES) as stored:
        assert str(stored["weights"]) == demo.BUNDLED_WEIGHTS_KIND
        committed = stored["pool"]
    assert committed.shape == (1797, 2048) and committed.dtype == np.float32
    fresh = extract_features([images[spot]], bundled_inception, keep_pool=True).pool.numpy()
    # Bit-identical on the machine that wrote them (batches of 50 and 100 measured); float32 convolutions may round
    # differently on a CPU of another vector width (~1e-6 relative). Features are post-ReLU averages of 0..7.
    np.testing.assert_allclose(committed[spot], fresh, rtol=1e-4, atol=1e-5)
    # the demo reads the committed features (not a recomputation) when they fit
    np.testing.assert_array_equal(demo.real_digit_features(images, extractor=None), committed.astype(np.float64))
