"""One request as the front-end holds it: its state, its output mailbox, its stream, and its ``n`` samples."""
