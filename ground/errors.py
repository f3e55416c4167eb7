"""The one exception type for errors a user can cause (bad upload, wrong backbone, bad setting)."""


class UserError(Exception):
    """An error whose message is written for the person who caused it; the UI and CLI show it as is."""


class Cancelled(Exception):
    """Raised inside long work when the user cancelled the job."""
