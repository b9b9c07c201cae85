"""The training verbs of ``sao-megatron``: train, sft, eval, parity, report, models smoke."""
