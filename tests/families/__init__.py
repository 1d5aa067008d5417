"""Model families that only the tests register: each is one module holding its row and its code."""
