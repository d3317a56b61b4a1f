"""From a failed replay to its culprit: the module call that produced it (`producers`), the op
recording pass (`ops`) and its provenance walk (`provenance`), and catching the culprit's
inputs in one more narrow replay (`catch`)."""
