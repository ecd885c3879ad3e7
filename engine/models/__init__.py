"""Model definitions: the Llama-family target decoder (and, with speculation, the MTP draft stack)."""
