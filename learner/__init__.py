"""The online learner: feedback from Kafka -> on-policy distillation -> candidates in MLflow.

One module per step of the path:

    consumer.py     consumer group on adaflash.feedback.v1, DLQ producer
    supervision.py  re-tokenize scrubbed text, run the frozen target once (hidden states, top-1,
                    exact full distributions on demand)
    buffer.py       replay buffer: per-tenant share cap, TTL, opt-out
    losses.py       hard CE, reverse KL, entry-wise clipped reverse KL, OPD mixture, forward KL
                    (OSD baseline), length-head MSE
    trainer.py      one OPD step over a buffer (epochs, accumulation, AdamW) + online length head
    checkpoint.py   weights + optimizer + de-duplication set + offsets + ledger, one atomic commit
    publish.py      candidate run + registered model version (state=candidate) with lineage
    service.py      the loop that ties them together; cli.py: ``adaflash learner``

Defaults (``learner:`` section of the config): alpha 0.8, delta 0.01, AdamW lr 3e-4
(drafter) and 2e-4 (length head), 2 epochs per buffer, batch 1, gradient accumulation
2 as in the paper. The paper's buffer holds 128 records; the default here is 32,
scaled for CPU. Measured on this 2-core machine with the real SmolLM2 target (one
thread, under load from other jobs): target prefill 83 tokens/s, one record's
micro-step (8 blocks of 16, full 49152-token distributions) 1.7 s. A 32-record buffer
(~10k tokens) is then a step of a few minutes with 32 optimizer updates (2 epochs x
32 records / accumulation 2); a 128-record one would take four times as long before
the drafter moves at all. Raise ``buffer_size`` to 128 on a GPU learner.

Guarantees: offsets are committed only after the checkpoint of the step that used the
records; a learner killed anywhere resumes with no record lost and none trained twice
(tests/learner/test_recovery.py kills it at four phases of a step); unusable records
go to the DLQ with a reason header; records past their tenant's TTL are never trained.
"""
