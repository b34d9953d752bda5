"""Shared streaming I/O: lazy readers (headers first), the header-first writer, output planning and
atomic output. Every command reads and writes through here."""
