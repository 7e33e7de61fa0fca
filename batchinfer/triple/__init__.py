"""triple"""
