"""Tokens and text, no I/O: the tokenizer, incremental UTF-8 detokenization, chat templates and
stop strings. Imports only the gateway's base (config, errors, logging) and common/."""
