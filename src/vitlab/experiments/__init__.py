"""The paper's claims re-run in miniature (`vitlab reproduce`): each experiment trains its arms
through vitlab.train, then reports the paper's claim and numbers, ours over seeds, and a verdict
computed by a stated rule (vitlab.experiments.verdict)."""
