"""The elastic driver: host discovery, blacklisting and generations of rank assignments (docs/elastic.md)."""
