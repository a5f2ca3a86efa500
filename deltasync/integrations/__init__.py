"""Integrations with training frameworks. Each lives in its own module and imports its framework
only there: ``deltasync.integrations.transformers`` (a ``transformers`` ``TrainerCallback``)."""
