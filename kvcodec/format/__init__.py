"""The KVC container: versioned safetensors profile, strict reader, atomic writer (formats/SPEC.md)."""
