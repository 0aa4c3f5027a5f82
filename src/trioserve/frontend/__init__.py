"""The front-end: tokenization, routing to engine cores, detokenization."""
