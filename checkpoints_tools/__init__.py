"""HF <-> Megatron checkpoint converters and the `sao-megatron convert` verb.

The declarative per-family mappings and the streaming exporter live in the
library (``sao_megatron.models.families``, ``sao_megatron.weights.export``)
because the trainer's weight sync needs them too; this package only drives
them from the command line. The library never imports this package.
"""
