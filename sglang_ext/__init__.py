"""SGLang server extension: a real SGLang engine behind a ZMQ control channel."""
