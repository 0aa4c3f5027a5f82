"""Text in and out of the front-end: tokenizer, incremental detokenizer, chat template, stop strings, prompt checks."""
