"""Experimental utilities (Monarch's ``monarch.experimental``): ``thread_timeout``."""
