"""The model runner: torch and transformers. Imported only inside worker
processes (and by tools that build models), never by the front-end."""
