"""The paper-miniature study: a matrix of named variants x seeds at an equal sample budget
(``sao-megatron study``), the statistics it reports and the tables and plots it writes."""
