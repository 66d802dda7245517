"""Quality studies: does a change make better samples? Each trains runs under one recipe, samples and scores them
with a judge (judges/) and FID, and writes its report into studies/results/ (JSON, Markdown table, plot).

    python -m studies.quality          VCA against MHSA on the coloured shapes, with ablations and a SiT pair
    python -m studies.repa_digits      REPA x attention on the digits (teacher: studies/digits_encoder/)
    python -m studies.posthoc_digits   post-hoc EMA and autoguidance on the digits
    python -m studies.recipe_digits    VCA against MHSA on the 2022 and the modern (LightningDiT) recipe, digits
    python -m studies.solvers          sample quality against steps of the fast DDPM solvers on the demo's model

studies.runner (training, sampling and scoring runs, resumably), studies.scorers (Inception, the real images and a
judge) and studies.report (spreads over seeds, readings, tables, plots) are their shared machinery; a study imports
no other study. Speed and memory are bench/'s.
"""
