"""The weights wing: getting the actor's weights from the trainer to the engines.

``export`` (the actor's weights under HF names), ``transports`` (which transport, picked once:
``disk``, ``distributed``, ``fp8_block``), ``staged`` (a push staged then delivered), ``publisher`` (the
one owner of a push: pause, deliver, commit), ``readmission`` (the served version and restarted
engines), ``send_buffers`` and ``verify``. The wire both sides speak (update groups, loader groups,
checksums) is ``rollout``'s. Import from the modules.
"""
