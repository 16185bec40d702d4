"""Pieces shared by jflash's public modules."""
