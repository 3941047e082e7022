"""Text-to-SQL: answer a question about a small sqlite database with a query."""
