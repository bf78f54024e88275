"""Wire format: packet header, binary codec, quantisers."""
